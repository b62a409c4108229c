"""Preparation: chat sources, chat templates and loss masks, perturbations, the draft vocab, the prepared
splits (build.py), and re-answering a data set with the target (regenerate.py)."""
