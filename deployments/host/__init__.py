"""Code that runs on the GPU host, plain Python: NVML, disk, downloads, engine processes (processes, serveargv,
processenv, processlog, osuser), systemd units, containers, the firewall, the one vLLM client.
May import the standard library, host libraries, its own modules, deployments.flagpolicy and plumbing's plain files; no Django."""
