"""Many hosts: which hosts a run targets (inventory, its readers inventory_files and
inventory_ansible, and --limit's host_patterns) and the rollout over them (rollout: batches,
parallel ssh sessions, stopping a rollout that fails too often). How a fleet run looks: cli/fleetview.py."""
