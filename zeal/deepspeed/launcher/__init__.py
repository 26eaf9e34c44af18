"""``deepspeed.launcher``: ``runner``'s constants (what ``accelerate launch --use_deepspeed``
imports). DeepSpeed's launcher itself is the ``zeal deepspeed`` command."""
