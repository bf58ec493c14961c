// The walk page's service worker, served at /sw.js and registered with scope /walk: it keeps the
// page shell (the page, its scripts, styles, icons and manifest) so the installed page opens without
// the network, and nothing else. Network first: whatever the server has now wins (a new walk.js
// is used on the next load); the kept copy is used only when the network fails. Every other request
// (the API, anything else) is not touched here and goes to the network as if there were no worker;
// websockets never pass through a service worker.

const CACHE = "djev-walk-shell-v1";
const SHELL = [
  "/walk",
  "/walk.webmanifest",
  "/static/css/djev.css",
  "/static/css/walk.css",
  "/static/js/api.js",
  "/static/js/camera.js",
  "/static/js/startup.js",
  "/static/js/walk.js",
  "/static/js/walk-cues.js",
  "/static/js/walk-view.js",
  "/static/walk/icon-180.png",
  "/static/walk/icon-192.png",
  "/static/walk/icon-512.png",
  "/static/walk/icon.svg",
];

self.addEventListener("install", (event) => {
  // A shell that cannot be fetched in full now is fetched piecemeal later; installing never fails on it.
  event.waitUntil(caches.open(CACHE)
    .then((cache) => cache.addAll(SHELL))
    .catch(() => {})
    .then(() => self.skipWaiting()));
});

self.addEventListener("activate", (event) => {
  event.waitUntil(
    caches.keys()
      .then((names) => Promise.all(names.filter((name) => name !== CACHE).map((name) => caches.delete(name))))
      .then(() => self.clients.claim()),
  );
});

// "/walk?stale_ms=..." is the shell too; the query does not change the page.
function shellPath(request) {
  if (request.method !== "GET") return null;
  const url = new URL(request.url);
  if (url.origin !== self.location.origin) return null;
  return SHELL.includes(url.pathname) ? url.pathname : null;
}

self.addEventListener("fetch", (event) => {
  const path = shellPath(event.request);
  if (path === null) return; // not the shell: the browser fetches it as usual, and nothing is kept
  event.respondWith(networkFirst(event.request, path));
});

async function networkFirst(request, path) {
  const cache = await caches.open(CACHE);
  try {
    // no-cache: revalidate with the server even where the HTTP cache holds a copy. (A navigation
    // cannot be re-made with options; the page itself is sent with no-store.)
    const response = request.mode === "navigate" ? await fetch(request) : await fetch(request, { cache: "no-cache" });
    if (response.ok && response.type === "basic") await cache.put(path, response.clone());
    return response;
  } catch (err) {
    const kept = await cache.match(path);
    if (kept) return kept;
    throw err;
  }
}
