"""The offline tuner: scan, space, cost model, search, dispatcher, ahead-of-time compilation, rewrite."""
