"""One pass per file; zerocc/pipeline.py lists them in order."""
