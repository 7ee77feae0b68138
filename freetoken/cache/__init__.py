"""Prefix reuse across requests: radix tree over token ids -> KV pages, recurrent-state
checkpoints at semantic anchors. Plain Python: the engine owns the tensors these index."""
