"""Prompt datasets (rows of prompt, ground_truth, data_source) and the loader that batches them."""
