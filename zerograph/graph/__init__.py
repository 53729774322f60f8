"""The graph's words: the markers capture leaves and the passes expand, their keys, the tag and
wait ops every stage shares, and the cost of a node or a collective."""
