"""The standalone indexer service (`conductor indexer`): KV events in, cache look-ups out."""
