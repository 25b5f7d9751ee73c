"""Every task name the code sends is a registered Celery task: services send tasks by name
(plumbing/queue.py), so a typo would only show when the message reaches a worker that drops it.

The names are read from the source with `ast`: string constants given to the senders (enqueue, node_enqueue,
send_now, send_task), returned by a function whose name says it picks a task, assigned to a *_TASK(S)
constant, or given as a beat schedule's "task"."""
import ast
import re
from pathlib import Path

from celery import current_app

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("controlpanel", "deployments", "benchmarks", "plumbing")
SENDERS = {"enqueue", "node_enqueue", "send_now", "send_task"}
TASK_NAME = re.compile(r"[a-z]+\.[a-z][a-z0-9_]*")


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and TASK_NAME.fullmatch(n.value)]


def _called(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def sent_names(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and _called(node) in SENDERS:
            for arg in node.args[:2]:  # enqueue(name, ...), node_enqueue(node, name, ...)
                if isinstance(arg, ast.Constant):
                    names.update(_strings(arg))
        elif isinstance(node, ast.FunctionDef) and "task" in node.name:
            for ret in (n for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None):
                names.update(_strings(ret.value))
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and re.fullmatch(r"[A-Z_]*_TASKS?", t.id)
                                                  for t in node.targets):
            names.update(_strings(node.value))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "task" and isinstance(value, ast.Constant):
                    names.update(_strings(value))
    return names


def test_every_task_name_the_code_sends_is_registered():
    sent = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" not in path.parts:
                for name in sent_names(path.read_text()):
                    sent.setdefault(name, path.relative_to(ROOT))
    assert len(sent) >= 15, sorted(sent)  # the reading finds the senders (18 names today)
    registered = set(current_app.tasks)
    assert {name: str(path) for name, path in sent.items() if name not in registered} == {}


def test_the_reading_sees_each_way_a_name_is_given():
    source = '''
enqueue("a.one", args=[])
node_enqueue(node, "a.two", 1)
queue.send_now("a.three", args=[])
DELIVER_TASK = "a.four"
CONTROL_TASKS = frozenset({"a.five"})
def _copy_task(copy):
    return "a.six" if copy else "a.seven"
SCHEDULE = {"x": {"task": "a.eight", "schedule": 30}}
log.info("not.atask")
'''
    assert sent_names(source) == {f"a.{n}" for n in ("one", "two", "three", "four", "five", "six", "seven", "eight")}
