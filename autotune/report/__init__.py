"""A study's trials as DataFrames, plotly figures and one self-contained HTML page."""
