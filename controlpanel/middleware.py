"""Every page needs a logged-in user, except the few listed here.

The API has its own authentication (session or token) through DRF's permission classes, so
`/api/` is left to DRF, which answers 401/403 as JSON instead of redirecting to the login page.
"""
from django.conf import settings
from django.contrib.auth.views import redirect_to_login

PUBLIC_PREFIXES = ("/accounts/login/", "/static/", "/healthz", "/api/")


class LoginRequiredMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if not request.user.is_authenticated and not request.path.startswith(PUBLIC_PREFIXES):
            return redirect_to_login(request.get_full_path(), settings.LOGIN_URL)
        return self.get_response(request)
