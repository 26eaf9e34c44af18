"""``deepspeed.launcher``: ``runner``'s constants (what ``accelerate launch --use_deepspeed``
imports). DeepSpeed's launcher itself is ``zeal deepspeed`` (:mod:`zeal.cli.deepspeed`)."""
