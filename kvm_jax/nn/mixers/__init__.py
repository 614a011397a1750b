"""The mixer kinds (a layer's token mixer): KVM, softmax attention (full, sliding window, block
window), OVQ, RWKV-7, cross-layer KV sharing, and their base class."""
