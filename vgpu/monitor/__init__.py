"""The node monitor: metrics from the hook's regions, the arbiter and the time share."""
