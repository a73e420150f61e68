"""The online micro-batch grouper: which node (and rank) runs each request, from its requests' expert
signatures."""
