"""What this machine is (CPU ISA, cores, NUMA, RAM, GPU, measured bandwidths) and the choices made from it."""
