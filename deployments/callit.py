"""How to call a deployment (issue 27 "Call it"): its base URL, the model name(s) it serves, whether a key
is needed, and curl and OpenAI-Python snippets that work as shown. One place, for the page, the API
(`call` in a deployment's representation) and `panelctl status`.

The snippets ask what the smoke test asks (a chat completion), so a deployment whose smoke test passed
answers them. A key is never printed: the snippets read it from VLLM_API_KEY, the variable vLLM itself
reads it from.
"""
import json
import shlex

from deployments.models import Deployment, ModelCopy, ModelRepo

KEY_ENV = "VLLM_API_KEY"
QUESTION = "What is the capital of France?"


def served_name(model: ModelRepo) -> str:
    """The name a deployment serves its model under when the user gives none: the repo id clients
    know it by (vLLM's own default, the folder path on the node, is one nobody can guess)."""
    return model.repo_id


def served_models(d: Deployment) -> list[str]:
    """The names clients put in "model": --served-model-name (the panel passes it as one argv word, so one
    name), else the path vLLM was given: the node's copy of the model."""
    name = str(d.engine_args.get("served-model-name") or "").strip()
    if name:
        return [name]
    copy = ModelCopy.objects.filter(model_id=d.model_id, node_id=d.node_id).exclude(path="").first()
    return [copy.path] if copy else []


def key_required(d: Deployment) -> bool:
    """vLLM refuses requests without the key when --api-key or VLLM_API_KEY is set."""
    return bool(d.engine_args.get("api-key")) or bool(d.env.get(KEY_ENV))


def call(d: Deployment) -> dict:
    """{base_url, models, key_required, curl, python} for deployment `d`."""
    base_url = f"{d.base_url}/v1"
    models = served_models(d)
    keyed = key_required(d)
    model = models[0] if models else ""
    return {"base_url": base_url, "models": models, "key_required": keyed,
            "curl": curl_snippet(base_url, model, keyed), "python": python_snippet(base_url, model, keyed)}


def curl_snippet(base_url: str, model: str, keyed: bool) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 64})
    lines = [f"curl {shlex.quote(base_url + '/chat/completions')}", '-H "Content-Type: application/json"']
    if keyed:
        lines.append(f'-H "Authorization: Bearer ${KEY_ENV}"')
    lines.append(f"-d {shlex.quote(body)}")
    return " \\\n  ".join(lines)


def python_snippet(base_url: str, model: str, keyed: bool) -> str:
    # json.dumps writes a double-quoted string with escapes, which is also a Python string literal.
    key = f'os.environ["{KEY_ENV}"]' if keyed else '"EMPTY"'  # the client needs some key; vLLM without one ignores it
    return "\n".join([
        *(["import os", ""] if keyed else []),
        "from openai import OpenAI",
        "",
        f"client = OpenAI(base_url={json.dumps(base_url)}, api_key={key})",
        "reply = client.chat.completions.create(",
        f"    model={json.dumps(model)},",
        f"    messages=[{{\"role\": \"user\", \"content\": {json.dumps(QUESTION)}}}],",
        "    max_tokens=64,",
        ")",
        "print(reply.choices[0].message.content)",
    ])
