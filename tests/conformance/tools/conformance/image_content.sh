#!/bin/sh
# output: content: one JSON object on stdout, a 1x1 red PNG as its image.
png='iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC'
printf '{"text": "A 1x1 red pixel.", "images": [{"mimeType": "image/png", "base64": "%s"}]}\n' "$png"
