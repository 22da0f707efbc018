"""Sequence state: KV buffers, recurrent state, the slot pool that holds many sequences, and the batch
descriptor of one step. Below the layers, which read and write it."""
