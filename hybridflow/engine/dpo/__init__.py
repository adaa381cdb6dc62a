"""Direct preference optimisation (``hf dpo train``): the loss, the pairs' token layout and the trainer's ranks."""
