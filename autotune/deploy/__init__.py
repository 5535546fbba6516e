"""The winner to the fleet: SGLang config and launcher, local/remote fleet, rolling restart."""
