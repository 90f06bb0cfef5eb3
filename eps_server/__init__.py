"""The Eager Param-Server: holds the model in shared memory, reduces and updates eagerly."""
