"""Expert-parallel load balancing: expert load statistics, a planner of replicas and their
placement on cards, and the placement the MoE layer follows."""
