"""lockserve.cluster.measure.harness: what every measurement command shares."""
