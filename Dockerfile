# The panel image: web (uvicorn/ASGI), control-plane worker and node agent run from it.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PANEL_VAR_DIR=/var/lib/panel STATIC_ROOT=/app/staticfiles
WORKDIR /app
COPY pyproject.toml README.md ./
COPY controlpanel controlpanel
COPY deployments deployments
COPY benchmarks benchmarks
COPY plumbing plumbing
COPY panelctl panelctl
RUN pip install .
COPY . .
# The settings refuse to load without a real key; this throwaway one only signs nothing at build time.
RUN SECRET_KEY="$(python -c 'import secrets; print(secrets.token_urlsafe(50))')" python manage.py collectstatic --noinput -v 0
EXPOSE 8000
CMD ["python", "-m", "uvicorn", "controlpanel.asgi:application", "--host", "0.0.0.0", "--port", "8000", "--ws", "plumbing.live.wsprotocol:WebSocketProtocol"]
