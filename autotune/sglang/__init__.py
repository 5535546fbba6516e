"""What autotune knows about SGLang itself: its flags, argument resolution, memory arithmetic and numerics."""
