"""The controller: the training loop (`loop.py`), packing generations into batches, validation, stop signals."""
