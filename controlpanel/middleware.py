"""Every page needs a logged-in user with a role, except the few listed here.

The API has its own authentication (session or token) through DRF's permission classes, so
`/api/` is left to DRF, which answers 401/403 as JSON instead of redirecting to the login page.
A logged-in user without a role gets a page saying to ask an admin (403), nothing else.
Works in both modes, so an ASGI request never hops to a thread just for this check.
"""
from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.shortcuts import render

from plumbing.roles import is_viewer

PUBLIC_PREFIXES = ("/accounts/login/", "/static/", "/healthz", "/api/", "/metrics")  # /metrics: DRF checks
# Open to a logged-in user without a role: leaving.
NO_ROLE_PREFIXES = ("/accounts/logout/",)


class LoginRequiredMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.is_async:
            return self._acall(request)
        return self._refusal(request, request.user) or self.get_response(request)

    async def _acall(self, request):
        user = await request.auser()
        refusal = await sync_to_async(self._refusal)(request, user) if user.is_authenticated else self._refusal(request, user)
        return refusal or await self.get_response(request)

    @staticmethod
    def _refusal(request, user):
        if request.path.startswith(PUBLIC_PREFIXES):
            return None
        if not user.is_authenticated:
            return redirect_to_login(request.get_full_path(), settings.LOGIN_URL)
        if not request.path.startswith(NO_ROLE_PREFIXES) and not is_viewer(user):
            return render(request, "no_role.html", status=403)
        return None
