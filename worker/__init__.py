"""l2l worker: the L2L execution loop of one device, against an Eager Param-Server."""
