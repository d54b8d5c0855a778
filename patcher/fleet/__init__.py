"""Many hosts: what a run is told about them (options: RemoteOptions, the --host, --inventory,
fleet and ssh flags as one value), how a host is written (host_address: the grammar, and Host),
which hosts a run targets (inventory, its readers
inventory_files and inventory_ansible, and --limit's host_patterns), the rollout over them
(rollout: batches, parallel ssh sessions, stopping a rollout that fails too often) and the run
end to end (command: check the inputs, roll out, tell, write the retry file). How a fleet run
looks: cli/fleetview.py."""
