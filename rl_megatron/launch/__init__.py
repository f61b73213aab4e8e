"""Multi-node launch: the checks that run before Ray starts, the cluster plan printed (`rl_megatron.planning`), Ray's
token authentication and the waits for the cluster. `launch/train_3d.sh` drives it through
`python -m rl_megatron.launch`."""
