"""bf16/fp16 compute with fp32 master weights; the fp16 loss scaler."""
