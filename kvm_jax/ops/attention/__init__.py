"""Softmax attention, its backends side by side: dense (the yardstick and the decode ring),
chunked (online softmax in ``lax``), and the resolver that picks cuDNN, splash, tokamax or
these (``api``)."""
