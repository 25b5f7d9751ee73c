"""Forms for the pages; the same validators back the API serializers."""
from django import forms

from deployments import validators
from deployments.models import Node


class ModelAddForm(forms.Form):
    repo_id = forms.CharField(label="Hugging Face repo", max_length=200, validators=[validators.validate_repo_id],
                              widget=forms.TextInput(attrs={"placeholder": "moonshotai/Kimi-K2.5"}))
    revision = forms.CharField(max_length=200, required=False, initial="main", validators=[validators.validate_revision])


class LocalModelForm(forms.Form):
    node = forms.ModelChoiceField(queryset=Node.objects.all())
    path = forms.CharField(label="Folder on the node", max_length=1024, validators=[validators.validate_local_path],
                           widget=forms.TextInput(attrs={"placeholder": "/models/my-model"}))


class DownloadForm(forms.Form):
    node = forms.ModelChoiceField(queryset=Node.objects.all())


class FitForm(forms.Form):
    tp = forms.TypedChoiceField(label="Tensor parallel", coerce=int, choices=[(n, n) for n in (1, 2, 4, 8, 16)], initial=8)
    kv_cache_dtype = forms.ChoiceField(label="KV cache", choices=[("auto", "auto"), ("fp8", "fp8")], initial="auto")


class HfTokenForm(forms.Form):
    # Write-only: the field is never pre-filled and the value never rendered back.
    hf_token = forms.CharField(label="Hugging Face token", required=False, max_length=256,
                               widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "off"}))
    clear = forms.BooleanField(required=False)
