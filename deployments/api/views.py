"""API views: validate, call one service, serialize. Errors share one shape (plumbing.api)."""
from dataclasses import asdict

from django.db import transaction
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response

from plumbing import longpoll
from plumbing.apicache import cached_read
from plumbing.errors import ServiceError
from plumbing.idempotency import idempotent
from plumbing.params import int_param

from deployments import energy, exports, modelfit, nodelive, secrets, selectors, versions
from deployments.api import serializers
from deployments.gateway import keys
from deployments.models import ModelCopy
from deployments.services import deploys, fitgate, loadtime, multinode, recipes, repos, rollbacks, sleeps


class NodeViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = serializers.NodeSerializer
    queryset = selectors.node_list()
    lookup_field = "name"
    lookup_value_regex = r"[a-z0-9][a-z0-9-]*"

    @cached_read(live=nodelive.NODES_LIVE)
    def list(self, request, *args, **kwargs):
        # Heartbeats and samples change this answer about 150 times a second at 128 nodes: the rows are kept
        # while no table they read changes (heartbeats write only apicache.LIVE_COLUMNS, which do not count),
        # and each node's live fields are read for every request, in one Redis call (deployments/nodelive.py).
        page = self.paginate_queryset(self.filter_queryset(self.get_queryset()))
        context = {**self.get_serializer_context(), "latest": {}}  # the live part comes from NODES_LIVE
        return self.get_paginated_response(self.get_serializer(page, many=True, context=context).data)

    @extend_schema(request=None, responses={202: serializers.NodeSerializer})
    @action(detail=True, methods=["post"], url_path="measure-disk")
    def measure_disk(self, request, name=None):
        """Measure the model store's sequential read rate on the node (cold cache where it can, at idle
        priority, never evicting a running engine's files); the result lands in `disk_read`."""
        node = self.get_object()
        loadtime.node_measure_disk_request(node)
        return Response(serializers.NodeSerializer(node).data, status=status.HTTP_202_ACCEPTED)


class ModelRepoViewSet(mixins.CreateModelMixin, mixins.DestroyModelMixin, viewsets.ReadOnlyModelViewSet):
    lookup_value_regex = r"[0-9]+"
    serializer_class = serializers.ModelRepoSerializer
    queryset = selectors.model_list()

    @extend_schema(parameters=[OpenApiParameter("repo_id", str)])
    @cached_read()
    def list(self, request):
        models = selectors.model_rows()
        if _param(request, "repo_id"):
            models = models.filter(repo_id=_param(request, "repo_id"))
        page = self.paginate_queryset(models)
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    @extend_schema(request=serializers.ModelAddSerializer, responses={202: serializers.ModelRepoSerializer})
    @idempotent
    def create(self, request):
        """Add a Hub repo or a local folder; it is inspected in the background (follow GET /api/models/{id}/)."""
        data = serializers.ModelAddSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        model = (repos.model_add_local(v["node"], v["local_path"]) if v.get("local_path")
                 else repos.model_add(v["repo_id"], v["revision"]))
        return Response(serializers.ModelRepoSerializer(model).data, status=status.HTTP_202_ACCEPTED)

    def destroy(self, request, pk=None):
        """Forget a model without copies or deployments (409 naming them otherwise)."""
        repos.model_remove(self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(parameters=[serializers.FitQuerySerializer], responses=dict)
    @action(detail=True)
    def fit(self, request, pk=None):
        """Does the model fit a node's GPUs at this TP×PP, and how much KV cache is left?"""
        query = serializers.FitQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        q = query.validated_data
        tp = q.get("tp") or modelfit.default_tp(q["node"].gpus.count())
        result = fitgate.model_fit(self.get_object(), q["node"], tp, q["pp"], q["gpu_memory_utilization"], q["kv_cache_dtype"])
        if result is None:
            raise ServiceError("The model's config has not been read yet.", field="model", code="not_inspected")
        return Response(asdict(result))

    @extend_schema(request=serializers.NodeChoiceSerializer, responses={202: serializers.ModelCopySerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def download(self, request, pk=None):
        """Download the model to a node; refused with 409 and what could be deleted when the disk is short."""
        body = serializers.NodeChoiceSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        copy = repos.model_download(self.get_object(), body.validated_data["node"])
        return Response(serializers.ModelCopySerializer(copy).data, status=status.HTTP_202_ACCEPTED)


class ModelCopyViewSet(mixins.DestroyModelMixin, viewsets.ReadOnlyModelViewSet):
    lookup_value_regex = r"[0-9]+"
    serializer_class = serializers.ModelCopySerializer
    queryset = ModelCopy.objects.select_related("node")

    @extend_schema(parameters=[OpenApiParameter("node", str), OpenApiParameter("model", int)])
    @cached_read()
    def list(self, request):
        copies = selectors.copy_rows()
        if _param(request, "node"):
            copies = copies.filter(node__name=_param(request, "node"))
        model = int_param(request.query_params, "model")
        if model is not None:
            copies = copies.filter(model_id=model)
        page = self.paginate_queryset(copies)
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    def destroy(self, request, pk=None):
        """Delete the copy's files on its node (409 while a deployment uses it)."""
        copy = repos.model_copy_delete(self.get_object())
        return Response(serializers.ModelCopySerializer(copy).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: serializers.ModelCopySerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def cancel(self, request, pk=None):
        """Stop a download; what was fetched stays for a retry."""
        copy = repos.model_copy_cancel(self.get_object())
        return Response(serializers.ModelCopySerializer(copy).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: serializers.ModelCopySerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def retry(self, request, pk=None):
        """Queue a failed or cancelled download again; it resumes."""
        copy = repos.model_copy_retry(self.get_object())
        return Response(serializers.ModelCopySerializer(copy).data, status=status.HTTP_202_ACCEPTED)


class DeploymentViewSet(mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet):
    lookup_value_regex = r"[0-9]+"
    queryset = selectors.deployment_list()

    @extend_schema(parameters=[OpenApiParameter("name", str), OpenApiParameter("node", str), OpenApiParameter("status", str)])
    @cached_read()
    def list(self, request):
        found = self.get_queryset()
        for param, field in (("name", "name"), ("node", "node__name"), ("status", "status")):
            if _param(request, param):
                found = found.filter(**{field: _param(request, param)})
        page = self.paginate_queryset(found)
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    def get_serializer_class(self):
        return serializers.DeploymentDetailSerializer if self.action != "list" else serializers.DeploymentSerializer

    @extend_schema(request=serializers.DeployRequestSerializer, responses={202: serializers.DeploymentDetailSerializer})
    @idempotent
    def create(self, request):
        """Deploy a model: the node's agent runs the plan (follow it with GET …/events/?wait=30)."""
        body = serializers.DeployRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        v = body.validated_data
        route = keys.route_check(aliases=v["aliases"], max_in_flight=v["max_in_flight"], queue_bound=v["queue_bound"],
                                 media_domains=v["media_domains"], user=request.user)
        with transaction.atomic():  # the route is saved before the plan is sent: the launch reads it
            d = deploys.deployment_create(model=v["model"], node=v["node"], gpu_indices=sorted(set(v["gpus"])), port=v["port"],
                                           engine_args=v["engine_args"], env=v["env"], secret_env=v["secret_env"], name=v["name"], replace_ids=v["replace"],
                                           auto_restart=v["auto_restart"], stall_seconds=v["stall_seconds"],
                                           retry_advised=v["retry_advised"],
                                           stop_foreign=v["stop_foreign"], prewarm=v["prewarm"], user=request.user,
                                           reuse_memory_profile=v["reuse_memory_profile"],
                                           preset="" if v["preset"] == "none" else v["preset"],
                                           replace_existing=v["replace_existing"], master_port=v["master_port"],
                                           override_fit=v["override_fit"], override_compat=v["override_compat"],
                                           sleep_mode=v["sleep_mode"], start_asleep=v["start_asleep"],
                                           recipe=recipes.recipe_choice(v["recipe"], v["variant"], v["strategy"])
                                           if v["recipe"] else None,
                                           workers=[multinode.Worker(w["node"], sorted(set(w["gpus"]))) for w in v["workers"]])
            keys.route_set(d, user=request.user, **route)
        return Response(serializers.DeploymentDetailSerializer(d).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: serializers.DeploymentDetailSerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def stop(self, request, pk=None):
        """Stop the engine (its whole process group or its systemd unit)."""
        return self._accepted(deploys.deployment_stop(self.get_object()))

    @extend_schema(request=serializers.RedeploySerializer, responses={202: serializers.DeploymentDetailSerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def restart(self, request, pk=None):
        """Run the plan again, optionally with changed settings; a running engine is stopped first."""
        body = serializers.RedeploySerializer(data=request.data)
        body.is_valid(raise_exception=True)
        changes = dict(body.validated_data)
        if "gpus" in changes:
            changes["gpu_indices"] = sorted(set(changes.pop("gpus")))
        if "workers" in changes:
            changes["workers"] = [multinode.Worker(w["node"], sorted(set(w["gpus"]))) for w in changes["workers"]]
        return self._accepted(deploys.deployment_redeploy(self.get_object(), user=request.user, **changes))

    @extend_schema(request=None, responses={202: serializers.DeploymentDetailSerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def persist(self, request, pk=None):
        """Install the deployment as a systemd unit on its node."""
        return self._accepted(deploys.deployment_persist(self.get_object()))

    @extend_schema(request=serializers.SleepSerializer, responses={202: serializers.DeploymentDetailSerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def sleep(self, request, pk=None):
        """Put a sleep-mode deployment to sleep; its GPUs are free for another sleep-mode deployment."""
        d = self.get_object()  # an unknown id is a 404 whatever the body says
        body = serializers.SleepSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        return self._accepted(sleeps.deployment_sleep(d, body.validated_data.get("level")))

    @extend_schema(request=None, responses={202: serializers.DeploymentDetailSerializer})
    @action(detail=True, methods=["post"], url_path="sleep-probe")
    @idempotent
    def sleep_probe(self, request, pk=None):
        """Sleep a ready sleep-mode deployment at each level and wake it, with GPU memory (NVML) and a fixed answer at
        temperature 0 compared; sleep and swaps use only the levels it proved. The figures: `sleep_probe`."""
        return self._accepted(sleeps.deployment_sleep_probe(self.get_object()))

    @extend_schema(request=None, responses={202: serializers.DeploymentDetailSerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def wake(self, request, pk=None):
        """Wake a sleeping deployment; refused (409) while another engine holds its GPUs (swap instead)."""
        return self._accepted(sleeps.deployment_wake(self.get_object()))

    @extend_schema(request=serializers.SwapSerializer, responses={202: serializers.DeploymentDetailSerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def swap(self, request, pk=None):
        """This serving deployment sleeps and `to` wakes on the same GPUs (a stopped `to` is deployed again); the
        gateway names (aliases) follow. Answers with `to`."""
        d = self.get_object()
        body = serializers.SwapSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        return self._accepted(sleeps.deployment_swap(d, body.validated_data["to"]))

    @extend_schema(request=serializers.RollbackSerializer, responses={202: serializers.DeploymentDetailSerializer})
    @action(detail=True, methods=["post"])
    @idempotent
    def rollback(self, request, pk=None):
        """Deploy a recorded version again exactly (default: the known good one, the last that reached ready), with the
        usual plan and gates; its timeline says "rollback to version N"."""
        d = self.get_object()
        body = serializers.RollbackSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        return self._accepted(rollbacks.deployment_rollback(d, body.validated_data.get("version"), user=request.user))

    @extend_schema(responses=dict)
    @action(detail=True)
    def versions(self, request, pk=None):
        """Every deploy and redeploy, newest first: the resolved request (secrets masked), its outcome (ready in N s
        with its steps, or failed with the reason), what changed from the one before, the known good one, and the
        benchmark runs made while it served."""
        return Response({"results": versions.listed(self.get_object())})

    @extend_schema(responses=dict)
    @action(detail=True)
    def export(self, request, pk=None):
        """The deployment as one JSON document: `request`, the body of POST /api/deployments/ that deploys it again
        (secrets as the mask, named in `secrets`: a deploy refuses the mask until each value is given), its gateway
        route, and `versions`, every deploy and redeploy with its outcome."""
        d = self.get_object()
        answer = Response(exports.export(d))
        answer["Content-Disposition"] = f'attachment; filename="{d.name}.json"'
        return answer

    @extend_schema(parameters=[OpenApiParameter("hours", int, description="how far back, the current hour included "
                                                                         "(default 24, at most a year)")],
                   responses=dict)
    @action(detail=True)
    def energy(self, request, pk=None):
        """What its GPUs drew while it was up, from their energy counters: joules, kWh, average and idle watts, output
        tokens, joules per output token gross and net of the idle draw; in all and hour by hour. Empty on a node
        without energy counters (CPU engines, GPUs before Volta)."""
        hours = int_param(request.query_params, "hours", 24, low=1, high=energy.MAX_HOURS)
        return Response(energy.deployment_energy(self.get_object().pk, hours))

    @extend_schema(parameters=[OpenApiParameter("state", str, description="the `state` of your last answer"),
                               OpenApiParameter("wait", int, description="seconds to wait for a change (max 30)")],
                   responses=dict)
    @action(detail=True)
    def events(self, request, pk=None):
        """Status and timeline; with `state` and `wait`, answers as soon as anything changed (a long poll)."""
        d = self.get_object()
        wait = min(int_param(request.query_params, "wait", 0), 30)
        with longpoll.slot(request.user.pk) as may_wait:  # one user cannot hold every web thread
            state, events = selectors.deployment_wait(d, _param(request, "state"), wait if may_wait else 0)
        d.refresh_from_db()
        return Response({"state": state, "status": d.status, "status_message": d.status_message,
                         "load_phase": d.load_phase, "load_percent": d.load_percent,
                         "events": serializers.DeploymentEventSerializer(events, many=True).data})

    @extend_schema(responses={200: str})
    @action(detail=True)
    def logs(self, request, pk=None):
        """The engine log's last lines (kept after the engine ends)."""
        d = self.get_object()
        return Response({"lines": secrets.redact_deployment(d, d.log_tail).splitlines()})

    @extend_schema(responses={200: str})
    @action(detail=True)
    def unit(self, request, pk=None):
        """The systemd unit for this deployment, to install by hand."""
        name, text = selectors.deployment_unit(self.get_object())
        return Response({"name": name, "text": text})

    @extend_schema(request=None, responses={202: None, 204: None})
    def destroy(self, request, pk=None):
        """Forget a stopped or failed deployment (204); a systemd unit is removed on its node first (202)."""
        gone = deploys.deployment_delete(self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT if gone else status.HTTP_202_ACCEPTED)

    def _accepted(self, d):
        return Response(serializers.DeploymentDetailSerializer(d).data, status=status.HTTP_202_ACCEPTED)


def _param(request, name: str) -> str:
    """A query parameter for a filter; text the database cannot hold (NUL) is a 400, not a 500."""
    value = request.query_params.get(name, "")
    if "\x00" in value or len(value) > 500:
        raise ValidationError({name: ["Invalid characters or too long."]})
    return value

