"""The deployments of infra/deploy/, run for real (opt-in: `just test-deploy`; not in
`just test`'s test paths). Each test skips, saying what is missing, where the machine
lacks its part: the image (`just image`), podman-compose, Slurm."""
