"""``deepspeed.ops.lamb``: DeepSpeed's fused LAMB is not part of zeal."""

raise ImportError("deepspeed.ops.lamb (FusedLamb) is not part of zeal: use deepspeed.ops.adam.FusedAdam or a "
                  "torch.optim optimizer (config 'optimizer.type': Adam, AdamW, SGD ...)")
