"""What the account page shows, beneath both views that render it (the account's own and the gateway's keys)."""
from django.contrib.auth.forms import PasswordChangeForm
from rest_framework.authtoken.models import Token

from deployments.gateway import forms, selectors
from plumbing.roles import is_admin


def account_keys(user, form=None) -> dict:
    """The account page's keys section: the user's own keys (an admin's: everyone's) and the create form."""
    everyone = is_admin(user)
    return {"caller_keys": selectors.keys_listed(None if everyone else user), "keys_everyone": everyone,
            "key_form": form or forms.KeyForm(), "measures": selectors.MEASURES}


def account_context(request, password_form=None) -> dict:
    """What the account page shows: the API token's state, the password form, the gateway keys section."""
    return {"has_token": Token.objects.filter(user=request.user).exists(),
            "password_form": password_form if password_form is not None else PasswordChangeForm(request.user), **account_keys(request.user)}
