"""The web dashboard at /ui: static files shipped inside the package (no build step, nothing fetched from the
internet). The page holds no data of its own: it calls the REST API with the key its user enters."""

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from api.errors import not_found

ASSETS = Path(__file__).resolve().parents[1] / "ui"
MEDIA_TYPES = {"app.js": "text/javascript", "style.css": "text/css"}

router = APIRouter(tags=["dashboard"])


@router.get("/ui", include_in_schema=False)
def dashboard():
    return FileResponse(ASSETS / "index.html", media_type="text/html")


@router.get("/ui/static/{name}", include_in_schema=False)
def asset(name: str):
    if name not in MEDIA_TYPES:
        raise not_found("dashboard file", name)
    return FileResponse(ASSETS / name, media_type=MEDIA_TYPES[name])
