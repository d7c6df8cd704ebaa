# all_jobs.sh -- start every P/D job of 2026-12-02 at once (each its own pc.sh bg job), P and D all on GPU 0.
bash build/gpu/pc.sh bg nemotronh-default pc_job.sh nemotronh default 27000
bash build/gpu/pc.sh bg nemotronh-pc pc_job.sh nemotronh pc 27100
bash build/gpu/pc.sh bg nemotronh-align pc_job.sh nemotronh align 27200
bash build/gpu/pc.sh bg granite-default pc_job.sh granite default 27300
bash build/gpu/pc.sh bg granite-pc pc_job.sh granite pc 27400
bash build/gpu/pc.sh bg granite-align pc_job.sh granite align 27500
bash build/gpu/pc.sh bg mtp-default pc_job.sh nemotronh-mtp default 27600
bash build/gpu/pc.sh bg mtp-pc pc_job.sh nemotronh-mtp pc 27700
