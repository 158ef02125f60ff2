"""WikiText-2: prefetch (the only network access), prepare (vocabulary + token ids, once), the prepared directory
(manifest.py: torch-free; prepared.py: the token ids, checked), windows for training and exact evaluation."""
