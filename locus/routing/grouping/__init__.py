"""The online micro-batch grouper: which node (and rank) runs each request."""
