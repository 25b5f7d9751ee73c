"""panelctl nodes: the GPU hosts the panel sees, their GPUs' memory and disk."""
from panelctl.client import emit


def cmd_nodes(panel, args):
    nodes = panel.get("nodes/")["results"]
    lines = []
    for n in nodes:
        gpus = n["live"]["gpus"] if n.get("live") else []
        mem = ", ".join(f"{g['index']}:{(g['memory_used'] or 0) / 2**30:.0f}/{(g['memory_total'] or 0) / 2**30:.0f} GiB" for g in gpus)
        lines.append(f"{n['name']:<20} {'online' if n['online'] else 'OFFLINE':<8} {len(n['gpus'])} GPU(s) "
                     f"disk free {n['disk_free'] / 2**30:,.1f} GiB  {mem or n['nvml_error'] or ''}")
    emit(nodes, args.json, lines)
    return 0


def add(sub) -> None:
    """The `nodes` subcommand (sub: with the common options)."""
    sub.add_parser("nodes", help="nodes, their GPUs' memory and disk").set_defaults(fn=cmd_nodes)
