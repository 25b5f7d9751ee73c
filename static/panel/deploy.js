// Deploy form: the fit verdict and the context table are the server's answer for the values shown; a change
// of any setting marks them as before the change ("Check fit" sends the values and shows the new answer).
// Deploy is off while the fit verdict shown says "does not fit" for the values shown; an admin's
// "Deploy anyway" turns it on, and so does a change of any setting (the server checks again).
(function () {
  const form = document.getElementById("deploy-form");
  if (!form) return;
  const button = document.getElementById("deploy-submit");
  const blocks = button && button.dataset.fitBlocks;
  const override = form.querySelector('input[name="override_fit"]');
  let changed = false;
  const update = () => { if (blocks) button.disabled = !(changed || (override && override.checked)); };
  const isOverride = (el) => el.name === "override_fit" || el.name === "override_compat";
  form.addEventListener("input", (event) => {
    if (isOverride(event.target)) return update();
    changed = true;
    document.querySelectorAll("[data-fit-stale]").forEach((el) => { el.hidden = false; });
    update();
  });
  form.addEventListener("change", (event) => { if (event.target === override) update(); });
})();
