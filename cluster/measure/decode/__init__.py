"""lockserve.cluster.measure.decode: the decode step measured (the bench, its sweep, the targets,
context parallel)."""
