"""Pagination with bounds: a huge limit or offset is clamped, not passed to the database."""
from rest_framework.pagination import LimitOffsetPagination

MAX_OFFSET = 2**31 - 1


class Pagination(LimitOffsetPagination):
    default_limit = 100
    max_limit = 1000

    def get_offset(self, request):
        return min(super().get_offset(request), MAX_OFFSET)
