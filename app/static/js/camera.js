// Camera helpers: open a camera into a <video>, capture JPEG frames from it.

export async function startCamera(video, { facingMode = "user", width = 640, height = 480 } = {}) {
  if (!navigator.mediaDevices?.getUserMedia) {
    const insecure = location.protocol !== "https:" && !["localhost", "127.0.0.1", "[::1]"].includes(location.hostname);
    throw new Error(insecure ? "no camera API (webcam needs https; use the TLS port)" : "no camera API in this browser");
  }
  const stream = await navigator.mediaDevices.getUserMedia({
    video: { facingMode: { ideal: facingMode }, width: { ideal: width }, height: { ideal: height } },
    audio: false,
  });
  video.srcObject = stream;
  video.muted = true;
  video.playsInline = true;
  await video.play().catch(() => {});
  if (!video.videoWidth) await new Promise((resolve) => video.addEventListener("loadedmetadata", resolve, { once: true }));
  return stream;
}

export function stopCamera(video) {
  const stream = video?.srcObject;
  if (stream) stream.getTracks().forEach((track) => track.stop());
  if (video) video.srcObject = null;
}

// One frame as a JPEG Blob. `width` scales the frame (height by aspect); null keeps the native size.
export function captureJpeg(video, canvas, { width = null, quality = 0.85 } = {}) {
  const nativeW = video.videoWidth || 640;
  const nativeH = video.videoHeight || 480;
  const w = width || nativeW;
  const h = Math.round((w * nativeH) / nativeW);
  canvas.width = w;
  canvas.height = h;
  canvas.getContext("2d").drawImage(video, 0, 0, w, h);
  return new Promise((resolve, reject) =>
    canvas.toBlob((blob) => (blob ? resolve(blob) : reject(new Error("could not encode a frame"))), "image/jpeg", quality));
}
