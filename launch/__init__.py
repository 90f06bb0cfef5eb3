"""l2l-launch: the whole job on one box with one command."""
