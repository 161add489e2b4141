#!/usr/bin/env bash
# Debian's headless Chromium + chromedriver for the review page's browser tests (they drive
# it over the DevTools protocol with aiohttp). ~2 min on a fresh bookworm machine.
set -euo pipefail
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium chromium-driver
fi
