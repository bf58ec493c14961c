// The start-up banner every page has: while /health says the model is starting, it shows the phase
// and its progress, polled each second; once the model is ready it goes, and the header names the
// device that answers. The server renders the banner shown only while the model is starting, so a
// page opened on a ready server never polls.

import { getHealth } from "./api.js";

const POLL_MS = 1000;

function render(banner, health) {
  const served = document.getElementById("served");
  if (health?.status === "starting") {
    banner.textContent = `the model is starting: ${health.phase} (${health.done}/${health.total})`;
    return true;
  }
  if (health?.status === "failed") {
    banner.textContent = `the model failed to load: ${health.reason}`;
    return false; // the server exits: nothing more to wait for
  }
  if (health === null) return true; // not reachable just now: keep the banner, ask again
  banner.hidden = true;
  if (served) served.textContent = `${health.model} · ${health.engine} · ${health.device}`;
  return false;
}

async function poll(banner) {
  if (render(banner, await getHealth())) setTimeout(() => poll(banner), POLL_MS);
}

const banner = document.getElementById("starting-banner");
if (banner && !banner.hidden) setTimeout(() => poll(banner), POLL_MS);
