"""Training the demo family and EAGLE heads (``specdec train``): data, loops, model cards."""
