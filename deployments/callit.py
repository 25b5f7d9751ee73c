"""How to call a deployment (its "Call it" card): the node gateway's base URL, the model names it
answers to for this deployment, that a caller key is needed, and curl and OpenAI-Python snippets that work as
shown. One place, for the page, the API (`call` in a deployment's representation) and `panelctl status`.

Callers never reach an engine itself: it listens on loopback with a key only the panel knows, and the node's
gateway (http://<node address>:<gateway port>/v1) checks the caller's own key, made on the account page or
with `panelctl keys create`. The snippets ask what the smoke test asks (a chat completion), so a deployment
whose smoke test passed answers them. A key is never printed: the snippets read it from OPENAI_API_KEY, the
variable the OpenAI clients themselves read.
"""
import json
import shlex

from deployments.gateway.models import Route
from deployments.models import Deployment, ModelCopy, ModelRepo

KEY_ENV = "OPENAI_API_KEY"
KEY_HELP = "a caller key of the gateway: create one on the account page or with `panelctl keys create`"
QUESTION = "What is the capital of France?"


def served_name(model: ModelRepo) -> str:
    """The name a deployment serves its model under when the user gives none: the repo id clients
    know it by (vLLM's own default, the folder path on the node, is one nobody can guess)."""
    return model.repo_id


def served_models(d: Deployment) -> list[str]:
    """The names the engine itself answers to: --served-model-name (the panel passes it as one argv word, so one
    name), else the path vLLM was given: the node's copy of the model."""
    name = str(d.engine_args.get("served-model-name") or "").strip()
    if name:
        return [name]
    copy = ModelCopy.objects.filter(model_id=d.model_id, node_id=d.node_id).exclude(path="").first()
    return [copy.path] if copy else []


def model_names(d: Deployment) -> list[str]:
    """What callers may put in "model" for it at the gateway: its served name, then its aliases (Route.names)."""
    aliases = Route.objects.filter(deployment_id=d.pk).values_list("names", flat=True).first() or []
    return list(dict.fromkeys([*served_models(d), *(str(a) for a in aliases if str(a).strip())]))


def gateway_url(d: Deployment) -> str:
    """The node gateway's OpenAI base URL (Deployment.base_url: the port its gateway reported, else the configured one)."""
    return f"{d.base_url}/v1"


def call(d: Deployment) -> dict:
    """{base_url, models, key_required, key_help, curl, python} for deployment `d`: always through its node's
    gateway, always with a caller key."""
    base_url = gateway_url(d)
    models = model_names(d)
    model = models[0] if models else ""
    return {"base_url": base_url, "models": models, "key_required": True, "key_help": KEY_HELP,
            "curl": curl_snippet(base_url, model), "python": python_snippet(base_url, model)}


def curl_snippet(base_url: str, model: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 64})
    lines = [f"curl {shlex.quote(base_url + '/chat/completions')}", '-H "Content-Type: application/json"',
             f'-H "Authorization: Bearer ${KEY_ENV}"', f"-d {shlex.quote(body)}"]
    return " \\\n  ".join(lines)


def python_snippet(base_url: str, model: str) -> str:
    # json.dumps writes a double-quoted string with escapes, which is also a Python string literal.
    return "\n".join([
        "import os",
        "",
        "from openai import OpenAI",
        "",
        f'client = OpenAI(base_url={json.dumps(base_url)}, api_key=os.environ["{KEY_ENV}"])',
        "reply = client.chat.completions.create(",
        f"    model={json.dumps(model)},",
        f"    messages=[{{\"role\": \"user\", \"content\": {json.dumps(QUESTION)}}}],",
        "    max_tokens=64,",
        ")",
        "print(reply.choices[0].message.content)",
    ])
