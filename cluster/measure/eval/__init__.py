"""lockserve.cluster.measure.eval: the quality evaluation (`lockserve eval retrieval`)."""
