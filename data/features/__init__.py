"""The feature store: its on-disk format and writer (store.py), the reader and global-plan loaders
(reader.py), what the trainer asks of any feature source (source.py), the batch type (batch.py) and row packing
(packing.py)."""
