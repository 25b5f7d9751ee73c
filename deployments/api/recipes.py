"""Recipes over the REST API: the loaded recipe and strategy files, and an import of a checkout's files
(what `panelctl recipes import PATH` sends); an import replaces what the same source imported before and
changes what deploys do, so it takes the admin role."""
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from deployments.models import Recipe
from deployments.services import recipes
from plumbing.errors import ServiceError
from plumbing.recipefiles import MAX_BYTES, MAX_FILES
from plumbing.roles import is_admin


class RecipeSerializer(serializers.ModelSerializer):
    variants = serializers.SerializerMethodField()
    strategies = serializers.SerializerMethodField()
    min_vllm_version = serializers.SerializerMethodField()

    class Meta:
        model = Recipe
        fields = ["id", "kind", "name", "source", "version", "path", "digest", "loaded", "variants", "strategies",
                  "min_vllm_version"]

    def get_variants(self, obj) -> dict:
        variants = obj.data.get("variants") if obj.kind == Recipe.Kind.MODEL else None
        return {name: {"precision": (v or {}).get("precision", ""), "vram_minimum_gb": (v or {}).get("vram_minimum_gb"),
                       "model_id": (v or {}).get("model_id", "")} for name, v in (variants or {}).items()}

    def get_strategies(self, obj) -> list:
        return list(obj.data.get("compatible_strategies") or []) if obj.kind == Recipe.Kind.MODEL else []

    def get_min_vllm_version(self, obj) -> str:
        return str((obj.data.get("model") or {}).get("min_vllm_version") or "") if obj.kind == Recipe.Kind.MODEL else ""


class RecipeFileSerializer(serializers.Serializer):
    path = serializers.CharField(max_length=400)
    text = serializers.CharField(max_length=MAX_BYTES, allow_blank=True, trim_whitespace=False)


class RecipeImportSerializer(serializers.Serializer):
    source = serializers.RegexField(r"^[\w.@/:+-]{1,200}$", help_text="A name for where the files come from, e.g. "
                                    "vllm-project/recipes; a second import under the same name replaces the first.")
    version = serializers.CharField(max_length=80, required=False, default="", allow_blank=True,
                                    help_text="The checkout's git commit (default: each file's sha256).")
    files = RecipeFileSerializer(many=True, max_length=MAX_FILES)


class RecipeViewSet(viewsets.ReadOnlyModelViewSet):
    """Recipe and strategy files in vllm-project/recipes' layout, with their source and version."""

    serializer_class = RecipeSerializer

    def get_queryset(self):
        recipes.recipes_sync()
        rows = Recipe.objects.all()
        if name := self.request.query_params.get("name"):
            rows = rows.filter(name__iexact=name)
        return rows

    @extend_schema(request=RecipeImportSerializer, responses={201: dict})
    @action(detail=False, methods=["post"], url_path="import")
    def import_files(self, request):
        """Store a checkout's models/<org>/<model>.yaml and strategies/<name>.yaml (admins); one malformed file
        refuses all of them, each error naming its file and field."""
        body = RecipeImportSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        if not is_admin(request.user):
            raise ServiceError("Importing recipes changes what deploys run: it needs the admin role.", code="forbidden")
        v = body.validated_data
        done = recipes.recipe_import([(f["path"], f["text"]) for f in v["files"]], v["source"], v["version"])
        return Response(done, status=status.HTTP_201_CREATED)
