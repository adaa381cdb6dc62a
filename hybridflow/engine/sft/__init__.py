"""Supervised fine-tuning (``hf sft train``): conversations as token rows with a loss mask on the assistant turns
(`conversations`), and the rank that trains on them (`trainer`)."""
